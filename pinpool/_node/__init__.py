"""pinpool._node"""
