"""`python -m vlseq_ext.bench` (console script `vlseq-bench`): our merge, flatten and training
against the seed loop, PyTorch's built-ins, NCCL and DDP, on whatever devices the machine has.

    vlseq-bench [--quick] [--suite all | SUITE[,SUITE...]] [--devices all | 2 | cuda:0,cuda:1 | cpu:2]
                [--out DIR] [--repeats N]        SUITE: merge, flatten, diag, train, sweep, tsc

Suites: merge (M1, M2), flatten (F1), diag (the measurements behind the design choices: kernel vs
host time, all-reduce crossover, optimizer-step options, host costs, trainer phases, what limits
the sweep's hardest points; modules vlseq_ext.bench.diag and .limits), train (W1, W2: the seed model and a large one), sweep (W3: model sizes x
samples per device x model forms against DDP and the best one-GPU loop; module
vlseq_ext.bench.sweep, whose docstring has the points, methods and timing), tsc (T1, T2: accuracy
and fit time of the aeon estimator SeqClassifier against aeon's 1-NN DTW and RDST; needs aeon; not
part of "all"; module vlseq_ext.bench.tsc, whose docstring has its methods and JSON). `--devices` takes the
specs of vlseq_ext.devices.parse_devices; without it, every GPU, or two CPU "devices" on a machine
without GPUs.

Writes DIR/bench-results.json, DIR/summary.md, DIR/merge_time.png, DIR/train_samples_per_s.png,
DIR/sweep_vs_best.png (plots need matplotlib) and prints the tables. Without GPUs it runs the CPU
versions (merges over several CPU "devices", the reference all-reduce, the trainer on ["cpu",
"cpu"], gloo DDP, the sweep with tiny models) and lists what it skipped and why (on CPU: flat
buffers up to 64 MB, 1 MB with --quick; of the k=32 workloads only w2_k32_seed, and not with
--quick; the flatten suite's 200 tensors hold 16 MB, not 256 MB; no kernel times). The flatten
suite runs on the first device only, so one device is enough for it. Every method runs guarded: a
failure is recorded under `errors` and the run goes on; bench-results.json is rewritten after
every method, so a run killed part way keeps what it measured. Order: merge, flatten and diag
suites, seed-model training, the worker processes (every suite's DDP and one-process-per-device
jobs, in one spawn), the large-model workloads, then the sweep's in-process measurements.

Duration on 2 x H200: merge, flatten and train about 4 minutes (measured: 242 s), diag about 2
minutes (measured on one H200: 120 s, of which limits ~70), the sweep about 6 (estimated from the measured per-method costs, see vlseq_ext.bench.sweep):
about 10 minutes in all. `--quick`: about 2 minutes without the sweep, under 3 for `--suite sweep`.
Where one command may not run that long, split the run: `--suite merge,flatten,diag,train`, then
`--suite sweep`, each with its own --out.

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
      p2p_copy_bidir_gbps: number (GB/s per direction with 256 MB copied 0 -> 1 and 1 -> 0 at once: the
                           ceiling of a 2-GPU all-reduce), p2p_copy_bidir_gbps_spread
      p2p_status: which path vlseq_ext.ops.all_reduce_ takes ("p2p", "copy_engine: <why>", "cpu")
    flatten:  (absent from results written before this suite existed)
      device: str (the first device of the run)
      seed_model: {numel: 26177, tensors: 6, bytes, min_calls_per_repeat: 500,
                   us_per_call.<method>, us_per_call_spread.<method>}
      many_tensors: {size: "256MB" ("16MB" on CPU), tensors: 200, numel, bytes, us.<method>, us_spread.<method>,
                     gbps_rw.<method>, gbps_rw_spread.<method>, fraction_of_copy: {<method>: median / copy's}}
    diag:  (see vlseq_ext.bench.diag for each section's layout)
      kernels: {<op>: {kernel_us, wall_us, host_us, kernel_share_of_wall}}   (GPUs)
      crossover: {<size>: {bytes, algbw_gbps.<method>, algbw_gbps_spread.<method>}}   (>= 2 GPUs)
      step_options: {us_per_step.<option>, us_per_step_spread.<option>}
      host: {us_per_call.<name>, us_per_call_spread.<name>}
      trainer_phases: {k<K>: {steps, samples_per_step, wall_us_per_step, host_us_per_step: {range: us},
                              busy_us_per_step: {device: us}}}
    train:
      sweep:
        <form>_<rnn>_h<H>_l<L>_k<K> (e.g. list_lstm_h256_l2_k32):
          {form: "list"|"one", rnn: "lstm"|"bigru", hidden, layers, k, params, pool_samples,
           samples_per_s.<method>, samples_per_s_spread.<method>, setup_s.<method> (build + warm-up and graph
           captures before timing), capture_s.<method>?, num_devices.<method>, notes.<method>,
           graph_stats.<method>?, one_gpu_best_method, ratio: {vs_ddp, vs_1gpu, vs_one_gpu_best, vs_best, vs_mp,
           vs_cudnn_loop, 1gpu_vs_one_gpu_best, 1gpu_vs_cudnn_loop} (vlseq / that method; vs_best: / max(DDP,
           one_gpu_best); vs_cudnn_loop: / one_gpu_cudnn; 1gpu_*: vlseq_1gpu / it; each where both were measured),
           target: {status: "met"|"missed"|"incomplete", checks: {vs_ddp|vs_1gpu|vs_one_gpu_best:
                    {value, op: ">=", threshold, ok}}}}
      sweep_info: {devices, models, ks, forms, pool_samples, lengths, ddp_method, optimizer: {method: str},
                   targets, repeats, target_s, deadline_s, mp_deadline_s}
      <workload> ("w1_k1_seed", "w2_k32_seed", "w1_k1_large", "w2_k32_large"):
        {model: {name, hidden_dim?, num_layers?}, params, k (samples per device per step), pool_samples,
         samples_per_s.<method>, samples_per_s_spread.<method>, setup_s.<method> (build + one warm-up pass),
         num_devices.<method>, notes.<method>, graph_stats.<method> (trainer CUDA-graph counters),
         ratios: {vs_<baseline>: {<method>: ratio}}  (w1: vs_one_gpu; w2: vs_ddp_nccl, vs_vlseq_1gpu)}
    targets: {M1|M2|W1|W2|F1: {workload, target, status: "met"|"missed"|"not run" (for method `vlseq`), ratio,
                            detail, checks: {name: {value, op, threshold, ok}},
                            best_variant?: {method, ratio, status} (a faster vlseq_* variant, if any),
                            fraction_of_bidir_copy? (M2)},
              W3: {workload, target, status: "met"|"missed"|"incomplete"|"not run", ratio (the lowest vs_best),
                   detail, points: {met, missed, incomplete}}}
    skipped: {key: reason}    errors: {key: "Type: message (file:line)"}
    tsc:  (only in runs of --suite tsc; layout in vlseq_ext.bench.tsc) {<data set>: {accuracy.<method>, fit_s.<method>,
           predict_s.<method> (+ _spread), runs.<method>, devices, notes, n_train, ...}, targets: {T1, T2}}
    timings_s: {merge, flatten, diag, train, sweep, tsc, ddp, total} (the suites run)    task_s: {task key: seconds}

Methods. merge: seed_style (per-parameter stack-sum on device 0, copied back), reduce_add_coalesced
(torch.cuda.comm, then copied back), cat_nccl (cat + torch.cuda.nccl.all_reduce + copy back; on flat
buffers just the all-reduce), nccl_flat (bare NCCL all-reduce of ready flat buffers, seed model
only), ddp_nccl / ddp_gloo (flatten + torch.distributed all-reduce + copy back in one process per
device), reference (vlseq_ext.reference, CPU runs only), vlseq (seed model: GradientMerger.merge, one
fused kernel; flat: ops.all_reduce_ algo "auto"), vlseq_unfused (ops.flatten, ops.all_reduce_, ops.unflatten_:
the same ops unfused), vlseq_<algo> (seed
model: ops.all_reduce_tensors_; flat: ops.all_reduce_; for every algo this build accepts among
root, one_shot, two_shot, copy_engine).
train: seed_style, one_gpu, one_gpu_packed, data_parallel, ddp_nccl / ddp_gloo, vlseq, vlseq_1gpu,
vlseq_eager, vlseq_noguard (see vlseq_ext.bench.train.NOTES). sweep: vlseq, vlseq_1gpu, vlseq_mp,
ddp_nccl / ddp_gloo, one_gpu_packed, one_gpu_cudnn (GPUs only), one_gpu, one_gpu_best (see vlseq_ext.bench.sweep).
flatten: vlseq (ops.flatten into a preallocated buffer), vlseq_unflatten (ops.unflatten_ back into
the tensors); seed model: flatten_dense_tensors (torch._utils._flatten_dense_tensors), cat
(torch.cat of views, allocating as the seed does); many tensors: cat (torch.cat with out=),
foreach_copy (torch._foreach_copy_ from views of the flat buffer: the unflatten baseline), copy (one
same-device copy of as many bytes: the ceiling).
"""
