"""skyrl_numerics.quant: bit-exact low-precision numerics (codecs, recipes, STE/QAT, KV simulation)."""
