"""pinpool._host"""
