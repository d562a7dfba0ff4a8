"""Every term the `simulate` output prints, explained: the epilog of `simulate --help`.

Kept next to the code that prints the terms (`report`, `model_report`, `sizing_report`);
tests check that each summary row's and `--model` row's name is here.
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
  prefix hits    the headline hit rate: hit tokens / the workload's prompt tokens, prompts
                 allocated again after a preemption left out (they hit their own blocks);
                 recent: the manager's stats over the last 1000 allocations, recomputes in
  recomputed     prompts allocated again after a preemption: their own hit rate (they hit
                 the blocks they had), and every allocation together (the manager's count)
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
  sweep columns  hit rate: the workload's (as prefix hits); recomp hit: recomputed prompts'
                 hit rate (- when none); peak use, mean use: held blocks as a share of the
                 pool; peak held: held
                 blocks at the peak; frag: fragmentation; mgr us/step and p99 us: manager
                 time per step; GiB, peak GiB: the pool and the peak held
model comparison (--model NAME):
  pool           each run's blocks x tokens per block = the same bytes (the budget)
  groups         KV-cache groups x layer pages per block (padding included, as vLLM)
  bytes/block    one pool block: every layer page of one group's block of tokens
  hit rate       the workload's hit rate in each run (recomputed prompts on their own row)
  peak           held blocks (all groups) at the step where they peak, and their GiB
  KV per live token
                 held KV bytes / tokens of the running sequences, summed over steps: a
                 token shared by several sequences (fork, prefix hit) counts for each, its
                 blocks once, so sharing lowers it (and so does a higher hit rate)
  KV per held token
                 held KV bytes / token positions the held blocks cover (the most blocks any
                 group holds x block size), summed over steps: what the layout itself costs
                 per token, sharing set aside; all-full: exactly the model's bytes per token
  memory saved   at equal memory: all-full KV per held token / the model's = how many times
                 the tokens the model's groups hold in the same bytes; at equal hits
                 (--equal-hits): the smallest pool of the model's groups tried that reaches
                 the all-full run's hit rate, against the budget (more runs: the pool
                 doubled or halved, then bisected)
  hit limit      what the full-attention groups alone had cached of the workload's prompts,
                 and how far the other groups cut it: a hit must be served by every group
                 (a sliding window needs its window's blocks, a chunk its chunk's, a state
                 group the block at the hit's end), read from the manager's KV events
  cut hits       per group, hit tokens the full-attention groups had cached that this
                 group alone could not serve, as a share of the workload's prompt tokens
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
