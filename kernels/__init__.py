"""skyrl_numerics.kernels"""
