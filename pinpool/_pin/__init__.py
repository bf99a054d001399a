"""pinpool._pin"""
