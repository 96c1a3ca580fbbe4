"""Top IR: a leaf package (it imports nothing else of topq): types, graph, op catalogue, builder, text, verifier,
rewriter and the float32 reference interpreter."""
