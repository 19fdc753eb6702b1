"""Reading traced FX graphs: the graph's inputs and their parameter FQNs, transformer-block
detection, node annotations, FX helpers, and the Plan skeleton a graph gets from its blocks and
parameters. Allocates nothing.
"""
