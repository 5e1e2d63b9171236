"""Several nodes: which node this is (flags, Slurm), the rendezvous through node 0's TCPStore,
what one node tells the others when it stops, and a node's account of its own silence."""
