"""Every statement of the store, as small named Core builders, beside the functions that run
them: one module per role.

- `folding`: a batch of mutations folded into rows (pure: no SQL, no connection);
- `commit`: a folded batch written in the leader's fenced transaction;
- `recovery`: what a new leader reads back, with quarantine of undecodable rows, and the
  repair of a lost leader row;
- `prune`: finished tasks deleted in bounded batches;
- `queries`: the store's reads (a task, the finished tasks, an output);
- `operators`: the read-only statements of the CLI and the dashboard.

Functions take a `Connection` and never commit: the caller owns the transaction. How the
statements run (compile caches, IN lists in chunks, COPY) is `execution`'s business; how values
are encoded and decoded is `codec`'s.
"""
