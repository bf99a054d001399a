"""pinpool._shared"""
