"""skyrl_numerics.replay"""
