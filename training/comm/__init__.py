"""Communication plumbing every other package uses: which rank is where (topology: regions,
local ranks, the intra- and cross-region process groups), gloo bound to the node's private
interface, the interface NCCL is told to use (iface), and sessions (per-start epoch and id,
key derivation per run, session, link and direction, the authenticated `Control` gather,
the rendezvous store). Imports only training.errors and training.spec (and pyroute2)."""
