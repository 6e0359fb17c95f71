"""Failure handling for the collectives: a fault on one rank becomes one named error on every
rank, never a hang, and the process still ends cleanly.

- `failure_notices`: a failing rank posts a notice in the store, so the others raise
  `PeerFailedError` naming it ([Note: failure notices]);
- `collective_history`: the last collectives of each rank, so a timeout or backend error
  is a `CollectiveError` naming the collective;
- `polled_waits`: waits that hear from the other ranks while they last (gloo's
  reduce-scatters waited for by one thread);
- `uneven_inputs`: a stuck rank posts where it is; ranks stuck in different places raise
  `UnevenInputsError` ([Note: uneven inputs]);
- `collective_order`: stage 3's check that every rank issues the same collectives, a
  `DivergenceError` on every rank otherwise ([Note: collective order]);
- `teardown`: at exit, abort what cannot complete, stop the waiting thread and destroy
  the process groups before the interpreter finalizes ([Note: ending the process]);
- `comm_view`: what the modules above see of a `Comm` (protocols it satisfies).

The collectives (`zerodp.comm.collectives`, `handles`, `stats`, ...) call into this
package; nothing here imports them (a contract in pyproject.toml): where failure handling
needs a `Comm`, it sees only the protocols of `comm_view`.
"""
