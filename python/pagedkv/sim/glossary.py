"""Every term the `simulate` output prints, explained: the epilog of `simulate --help`.

Kept next to the code that prints the terms (`report`, `sizing_report`); a test checks that
each summary row's name is here.
"""

GLOSSARY = """\
what the output says:
  GPU blocks     the pool: blocks x tokens per block (= GiB with --kv-bytes-per-token or a
                 one-group --model); CPU blocks are swap space
  requests       finished, rejected (could never fit the pool), aborted (--abort-rate);
                 sequences: samples and beams count one each; forks: sequences made by fork;
                 beams pruned: beams freed by beam search
  tokens         the workload's prompt tokens + generated tokens (the outputs of the
                 sequences that finished; the workload line's "to generate" when every
                 request finishes); appended: tokens decode steps added, pruned beams'
                 included, tokens shared by forks counted once
  allocated      prompt tokens given to allocate: the workload's, plus recomputed ones (a
                 sequence preempted without swap space is allocated again, its generated
                 tokens as prompt); from the prefix cache (hits) or computed
  steps          executed: scheduler steps that ran; clock: simulated steps, idle stretches
                 between arrivals included (a trace's steps are --ms-per-step each)
  scheduling     chunked prefill: prefill chunks (allocate or extend calls that scheduled
                 prompt tokens), prompts that took several steps, tokens scheduled per step
  prefix hits    hit tokens / allocated prompt tokens (recomputes included, as the
                 manager's stats count them; the workload's prompts alone when they differ);
                 recent: over the last 1000 allocations
  registration   blocks registered in the prefix cache; retracted: registered but never
                 computed (an abort); released by truncate (rejected drafts)
  held           blocks referenced by running sequences: peak and mean over executed steps,
                 and as a share of the pool
  cached         evictable blocks: no sequence holds them, they still serve prefix hits,
                 least recently released evicted first when a block is needed
  evictions      cached blocks taken for reuse
  preemptions    running sequences stopped for lack of blocks: swapped out to CPU blocks, or
                 freed and recomputed later; swapped in: brought back
  swaps          blocks copied out to and back from CPU swap space
  copy-on-write  blocks copied because a shared block was written (forks, beams)
  speculation    drafts proposed and accepted (--spec-tokens), tokens per decoding sequence
                 and step, truncate calls that gave rejected drafts' blocks back
  aborts         requests aborted (--abort-rate) and their sequences; their blocks that
                 were registered but never computed are retracted
  fragmentation  slots of held blocks holding no token (mean over steps)
  manager time   time inside the manager's calls (total, per step mean and 99th
                 percentile, per token)
  wall time      the whole replay, scheduler included (manager: its share)
  sweep columns  peak use, mean use: held blocks as a share of the pool; peak held: held
                 blocks at the peak; frag: fragmentation; mgr us/step and p99 us: manager
                 time per step; GiB, peak GiB: the pool and the peak held
miss-ratio curve (--mrc):
  the prefix-cache hit rate an LRU cache of each size would have, over the workload's
  prompts, from one replay: exact stack distances over every block touch (registration,
  hit, release), or SHARDS sampling (an estimate) for large workloads; flat from: the size
  past which every hit is in. It models an LRU cache, not pinning or preemption: the
  recommendation checks its sizes with full runs.
sizing:
  the smallest cache (blocks, tokens, GiB) whose full run reaches the target hit rate
  with no preemption and no rejected request; curve estimate: where the curve reaches the
  target (with --mrc-only the answer, marked as the curve's); runs: every size simulated,
  with why it failed (stopped early: the run ended once it could no longer pass), the
  curve's own run included; time: wall and CPU (user + sys, workers included)
"""

__all__ = ["GLOSSARY"]
