"""skyrl_numerics.quant"""
