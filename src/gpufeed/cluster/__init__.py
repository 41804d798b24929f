"""The cache cluster: which nodes exist (membership in Redis) and which of them own a block
(rendezvous hashing, a pure function every node computes alike). Peers serve each other's
misses through `gpufeed.agent.peers`."""
