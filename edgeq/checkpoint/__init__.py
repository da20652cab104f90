"""edgeq.checkpoint"""
