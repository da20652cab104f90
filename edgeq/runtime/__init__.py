"""edgeq.runtime"""
