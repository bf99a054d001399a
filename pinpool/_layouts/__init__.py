"""pinpool._layouts"""
