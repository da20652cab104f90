"""edgeq/bench"""
