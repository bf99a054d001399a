"""pinpool._plan"""
