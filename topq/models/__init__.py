"""Machinery that model-family plugins share (as `topq.quant` is for schemes): the decoder config vocabulary and
the weight mapping with transforms."""
