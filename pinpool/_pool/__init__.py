"""pinpool._pool"""
