"""edgeq/fidelity"""
