"""edgeq/convert"""
