"""edgeq/inspect"""
