"""edgeq.quantize"""
