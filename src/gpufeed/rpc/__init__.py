"""The local protocol between readers and the node agent: typed messages (`messages`) and their framing (`codec`)."""
