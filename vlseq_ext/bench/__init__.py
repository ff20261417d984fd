"""`python -m vlseq_ext.bench` (console script `vlseq-bench`): our merge, flatten and training
against the seed loop, PyTorch's built-ins, NCCL and DDP, on whatever devices the machine has.

    vlseq-bench [--quick] [--suite merge|train|flatten|all] [--devices 2 | 0,1 | cpu:2] [--out DIR] [--repeats N]

Writes DIR/bench-results.json, DIR/summary.md, DIR/merge_time.png, DIR/train_samples_per_s.png
(plots need matplotlib) and prints the tables. Without GPUs it runs the CPU versions (merges over
several CPU "devices", the reference all-reduce, the trainer on ["cpu", "cpu"], gloo DDP) and
lists what it skipped and why (on CPU: flat buffers up to 64 MB, 1 MB with --quick; of the k=32
workloads only w2_k32_seed, and not with --quick; the flatten suite's 200 tensors hold 16 MB, not
256 MB). The flatten suite runs on the first device only, so one device is enough for it. Every
method runs guarded: a failure is recorded under `errors` and the run goes on; bench-results.json
is rewritten after every method, so a run killed part way keeps what it measured. Order: merge
suite, flatten suite, seed-model training, the DDP processes (all their jobs in one spawn), then
the large-model workloads.

Timing: synchronized loops (sync every device, run the op many times with no sync inside, sync),
warm-up first; every figure is the median of the repeats, with {median, min, max, n} beside it.
Units: µs; GB/s = 1e9 bytes/s; algorithm bandwidth = buffer bytes / time (as nccl-tests' algbw);
flatten bandwidth (gbps_rw) = bytes read + written / time = 2 x buffer bytes / time.

JSON schema (bench-results.json, schema_version 1). Where a key path below ends in `.<method>`
its value is a plain number (the median); the sibling `<name>_spread.<method>` holds
{"median", "min", "max", "n"}:

    schema_version: 1
    meta: {date, command, argv, quick, suite, devices: [str], device_type: "cuda"|"cpu", num_devices,
           gpu_count, gpu_names: [str], peer_access: [[bool]] (i reads j), torch, cuda, cudnn, nccl,
           driver, python, platform, cpu_count, torch_threads, extension_loaded, extension_cuda_kernels, env}
    merge:
      devices: [str]
      seed_model: {numel: 26177, tensors: 6, bytes, min_merges_per_repeat: 500,
                   us_per_merge.<method>, us_per_merge_spread.<method>}
      flat_fp32 | flat_bf16:
        <size> ("1MB" | "16MB" | "64MB" | "256MB", MiB): {bytes, numel, us.<method>, us_spread.<method>,
                                                         algbw_gbps.<method>, algbw_gbps_spread.<method>}
      p2p_copy_gbps: number (256 MB copy device 0 -> device 1), p2p_copy_gbps_spread, p2p_copy_direction
      p2p_status: which path vlseq_ext.ops.all_reduce_ takes ("p2p", "copy_engine: <why>", "cpu")
    flatten:  (absent from results written before this suite existed)
      device: str (the first device of the run)
      seed_model: {numel: 26177, tensors: 6, bytes, min_calls_per_repeat: 500,
                   us_per_call.<method>, us_per_call_spread.<method>}
      many_tensors: {size: "256MB" ("16MB" on CPU), tensors: 200, numel, bytes, us.<method>, us_spread.<method>,
                     gbps_rw.<method>, gbps_rw_spread.<method>, fraction_of_copy: {<method>: median / copy's}}
    train:
      <workload> ("w1_k1_seed", "w2_k32_seed", "w1_k1_large", "w2_k32_large"):
        {model: {name, hidden_dim?, num_layers?}, params, k (samples per device per step), pool_samples,
         samples_per_s.<method>, samples_per_s_spread.<method>, setup_s.<method> (build + one warm-up pass),
         num_devices.<method>, notes.<method>, graph_stats.<method> (trainer CUDA-graph counters),
         ratios: {vs_<baseline>: {<method>: ratio}}  (w1: vs_one_gpu; w2: vs_ddp_nccl, vs_vlseq_1gpu)}
    targets: {M1|M2|W1|W2|F1: {workload, target, status: "met"|"missed"|"not run" (for method `vlseq`), ratio,
                            detail, checks: {name: {value, op, threshold, ok}},
                            best_variant?: {method, ratio, status} (a faster vlseq_* variant, if any)}}
    skipped: {key: reason}    errors: {key: "Type: message (file:line)"}
    timings_s: {merge, flatten, train, ddp, total}    task_s: {task key: seconds}

Methods. merge: seed_style (per-parameter stack-sum on device 0, copied back), reduce_add_coalesced
(torch.cuda.comm, then copied back), cat_nccl (cat + torch.cuda.nccl.all_reduce + copy back; on flat
buffers just the all-reduce), nccl_flat (bare NCCL all-reduce of ready flat buffers, seed model
only), ddp_nccl / ddp_gloo (flatten + torch.distributed all-reduce + copy back in one process per
device), reference (vlseq_ext.reference, CPU runs only), vlseq (seed model: GradientMerger(fused=True);
flat: ops.all_reduce_ algo "auto"), vlseq_unfused (GradientMerger(fused=False)), vlseq_<algo> (seed
model: ops.all_reduce_tensors_; flat: ops.all_reduce_; for every algo this build accepts among
root, one_shot, two_shot, copy_engine).
train: seed_style, one_gpu, one_gpu_packed, data_parallel, ddp_nccl / ddp_gloo, vlseq, vlseq_1gpu,
vlseq_eager, vlseq_noguard (see vlseq_ext.bench.train.NOTES).
flatten: vlseq (ops.flatten into a preallocated buffer), vlseq_unflatten (ops.unflatten_ back into
the tensors); seed model: flatten_dense_tensors (torch._utils._flatten_dense_tensors), cat
(torch.cat of views, allocating as the seed does); many tensors: cat (torch.cat with out=),
foreach_copy (torch._foreach_copy_ from views of the flat buffer: the unflatten baseline), copy (one
same-device copy of as many bytes: the ceiling).
"""
