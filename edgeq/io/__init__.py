"""edgeq/io"""
