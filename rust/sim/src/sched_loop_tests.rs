//! The scheduling loop on its own (tests/sim/test_sim_rust_loop.py compares it with the
//! Python scheduler call for call): what a run must add up to, the stop rule, refused input.

use crate::sched_input::{InputError, Options, Prompt, Request, StopRule};
use crate::sched_log::Call;
use crate::sched_loop::{run_schedule, LoopError};
use pagedkv_core::{BlockManager, Config};

fn request(id: u64, len: usize, new: usize, samples: usize, at: u64) -> Request {
    Request {
        id,
        prompt: Prompt::Tokens(
            (0..len as u32)
                .map(|t| t % 7 + 100 * (id as u32 % 3))
                .collect(),
        ),
        prompt_len: len,
        max_new_tokens: new,
        samples,
        cache_salt: None,
        root: 0,
        arrival_step: at,
        after: None,
        delay: 0,
    }
}

fn options(budget: usize) -> Options {
    Options {
        max_batch: 256,
        budget,
        long_prefill_token_threshold: 0,
        skip_sure_checks: true,
        record: true,
        stop: None,
    }
}

fn never_stop(_: u64, _: u64) -> bool {
    true
}

#[test]
fn every_request_finishes_and_every_token_is_counted() {
    let m = BlockManager::new(Config::new(256, 16)).unwrap();
    let mut reqs: Vec<Request> = (0..12)
        .map(|i| request(i, 40 + 9 * i as usize, 5, 1 + (i as usize % 3), i / 2))
        .collect();
    reqs[5].after = Some(2); // a follow-up: arrives after request 2 ended
    reqs[5].delay = 3;
    let out = run_schedule(&m, &reqs, &options(64), Vec::new(), &mut never_stop).unwrap();
    let c = &out.counters;
    assert_eq!(c.finished_requests, 12);
    let sequences: u64 = reqs.iter().map(|r| r.samples as u64).sum();
    assert_eq!(c.finished_sequences, sequences);
    assert_eq!(c.forks, sequences - 12);
    assert_eq!(c.output_tokens, sequences * 5);
    assert_eq!(
        c.workload_prompt_tokens(),
        reqs.iter().map(|r| r.prompt_len as u64).sum::<u64>()
    );
    assert!(
        c.chunked_prompts > 0,
        "a 64-token budget chunks the longer prompts"
    );
    assert!(
        c.prefix_hit_tokens > 0,
        "prompts of the same id class share prefixes"
    );
    assert_eq!(out.series.step.len() as u64, c.steps);
    assert!(
        out.series.scheduled_tokens.iter().all(|&t| t <= 64),
        "the budget holds"
    );
    assert_eq!(
        m.num_free_blocks() + m.num_cached_blocks(),
        256,
        "everything freed"
    );
    let log = out.log.unwrap();
    assert_eq!(log.len() as u64, c.manager_calls);
    assert_eq!(log[0].call, Call::CanAllocateCount(40));
    // The follow-up waits for its parent: admitted after request 2's sequences were freed.
    let freed = log
        .iter()
        .position(|l| matches!(&l.call, Call::FreeBatch(ids) if ids.contains(&2)))
        .unwrap();
    let admitted = log
        .iter()
        .position(|l| matches!(&l.call, Call::Allocate { seq_id: 5, .. }))
        .unwrap();
    assert!(freed < admitted);
}

#[test]
fn the_stop_rule_ends_the_run_at_the_first_preemption() {
    let m = BlockManager::new(Config::new(24, 16)).unwrap();
    let reqs: Vec<Request> = (0..6).map(|i| request(i, 100, 60, 1, 0)).collect();
    let mut opts = options(512);
    let unstopped = run_schedule(&m, &reqs, &opts, Vec::new(), &mut never_stop).unwrap();
    assert!(unstopped.counters.preemptions() > 0);
    assert!(!unstopped.counters.stopped_early);
    let m = BlockManager::new(Config::new(24, 16)).unwrap();
    opts.stop = Some(StopRule {
        target_hits: 0.0,
        prompt_tokens: 600,
        rest: None,
    });
    let out = run_schedule(&m, &reqs, &opts, Vec::new(), &mut never_stop).unwrap();
    assert!(out.counters.stopped_early);
    // It stops after the first step that preempted, with that step's preemptions.
    let first = unstopped
        .series
        .preemptions
        .iter()
        .position(|&p| p > 0)
        .unwrap();
    assert_eq!(out.counters.steps, first as u64 + 1);
    assert_eq!(
        out.counters.preemptions(),
        unstopped.series.preemptions[first]
    );
    assert!(out.counters.steps < unstopped.counters.steps);
}

#[test]
fn the_hook_stops_the_run() {
    let m = BlockManager::new(Config::new(256, 16)).unwrap();
    let reqs: Vec<Request> = (0..4).map(|i| request(i, 30, 10, 1, 0)).collect();
    let mut steps = 0;
    let mut hook = |_: u64, _: u64| {
        steps += 1;
        steps < 3
    };
    let out = run_schedule(&m, &reqs, &options(64), Vec::new(), &mut hook);
    assert!(matches!(out, Err(LoopError::Stopped)));
    assert_eq!(steps, 3);
}

#[test]
fn bad_input_is_refused_before_any_call() {
    let m = BlockManager::new(Config::new(64, 16)).unwrap();
    let mut short = request(1, 10, 4, 1, 0);
    short.prompt_len = 12;
    let err = run_schedule(&m, &[short], &options(64), Vec::new(), &mut never_stop);
    assert!(matches!(
        err,
        Err(LoopError::Input(InputError::PromptLen(1, 12, 10)))
    ));
    let err = run_schedule(
        &m,
        &[request(1, 10, 4, 0, 0)],
        &options(64),
        Vec::new(),
        &mut never_stop,
    );
    assert!(matches!(err, Err(LoopError::Input(InputError::Samples(1)))));
    let err = run_schedule(
        &m,
        &[request(1, 10, 4, 1, 0)],
        &options(0),
        Vec::new(),
        &mut never_stop,
    );
    assert!(matches!(err, Err(LoopError::Input(InputError::Budget))));
    assert_eq!(m.num_free_blocks(), 64);
    assert_eq!(m.stats().prefix_queries, 0);
}
