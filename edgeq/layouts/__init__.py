"""edgeq.layouts"""
