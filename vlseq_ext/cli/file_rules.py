"""The file rules: what vlseq-train and vlseq-predict may do with the files they are pointed at, as
one table (RULES, also in docs/design.md), and the checks that apply them before anything is written.

Each rule names the tests that show it. A refusal's one line is the rule's message, filled in by
the check that found it (`refuse`); the other rules say what the code does where it writes.
"""
from __future__ import annotations

import os
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, NoReturn, Optional, Sequence, Tuple

from ..checkpoint import CHECKPOINT_NAME, CheckpointError, read_checkpoint
from ..files import is_stream, is_terminal
from .checks import CLIError, check_dir, check_file, plot_formats

__all__ = ["Rule", "RULES", "OUTPUT_NAMES", "refuse", "same_file", "holds_checkpoint", "check_outputs_distinct",
           "check_outputs_replaceable", "check_output_paths", "check_not_a_previous_run", "check_new_output",
           "check_resume_target"]


TEXT_PLOT_FORMATS = ("svg", "eps", "ps", "pgf")  # what matplotlib writes as text; the rest is binary


@dataclass(frozen=True)
class Rule:
    key: str
    when: str
    then: str
    tests: Tuple[str, ...]  # test functions (tests/) that show the rule
    message: Optional[str] = None  # a refusal's one line, str.format-ted with what the check found


def _rules(*rows: Rule) -> Dict[str, Rule]:
    return {r.key: r for r in rows}


RULES: Dict[str, Rule] = _rules(
    Rule("new-run-over-a-run", "a new run's --checkpoint-dir holds a checkpoint",
         "refused: continue it with --resume, choose another folder, or --overwrite",
         ("test_a_new_run_refuses_a_folder_that_holds_a_run",),
         "--checkpoint-dir {dir} already holds a run ({names}): continue it with --resume {dir}, choose another "
         "--checkpoint-dir, or pass --overwrite to replace it"),
    Rule("new-run-over-a-file", "a new run's --metrics or --plot, given by name, holds something",
         "refused: choose another file, or --overwrite (an empty file is taken over)",
         ("test_a_new_run_refuses_a_folder_that_holds_a_run", "test_a_new_run_keeps_an_existing_plot"),
         "{flag} {path} already exists: choose another {flag} file, or pass --overwrite to replace it"),
    Rule("leftovers-without-checkpoint", "a new run's folder holds metrics or a plot but no checkpoint",
         "refused: there is nothing to resume; choose another folder, or --overwrite",
         ("test_a_new_run_refuses_a_folder_that_holds_a_run",),
         "--checkpoint-dir {dir} holds the outputs of a run that saved no checkpoint ({names}), so there is "
         "nothing to resume: choose another --checkpoint-dir, or pass --overwrite to replace them"),
    Rule("overwrite", "--overwrite, over an old run's folder or files",
         "the old run's files are replaced; its checkpoint is removed once the data, devices and model check out, "
         "so neither bad input nor a crash before the first new checkpoint leaves it beside the new metrics",
         ("test_an_overwrite_that_dies_early_leaves_no_old_checkpoint_to_resume",
          "test_an_overwrite_with_bad_input_keeps_the_old_checkpoint"),
         "--overwrite: cannot remove the old checkpoint {path}: {reason}"),
    Rule("overwrite-or-resume", "--overwrite with --resume", "refused: one starts a new run, the other continues one",
         ("test_a_new_run_refuses_a_folder_that_holds_a_run",),
         "--overwrite starts a new run and --resume continues one: give one of them"),
    Rule("resume-target", "a resume writes its folder's last.pt, which is not the checkpoint resumed",
         "an earlier checkpoint of the same run (run id) is replaced; another run's, or a later one of this run, "
         "is refused",
         ("test_a_resume_never_replaces_another_run_or_a_later_point",),
         "--checkpoint-dir {dir}: {target} holds {what}; resuming {resumed} here would replace it: give another "
         "--checkpoint-dir (a fork of the resumed run)"),
    Rule("fork", "--resume RUN --checkpoint-dir NEW (another folder)",
         "a run of its own: a new run id (forked_from names RUN's), metrics and plot in NEW unless given, and "
         "RUN's files untouched",
         ("test_a_fork_leaves_the_original_runs_files_alone", "test_forks_are_runs_of_their_own")),
    Rule("fork-into-a-run", "a fork's NEW folder holds a checkpoint, metrics or a plot",
         "refused: fork into a new folder",
         ("test_a_resume_never_replaces_another_run_or_a_later_point",),
         "--checkpoint-dir {dir} already holds files of another run ({names}): fork into a new --checkpoint-dir"),
    Rule("fork-over-a-file", "a fork's --metrics or --plot, given by name, holds something",
         "refused, naming that flag: a fork starts its own files", ("test_a_fork_refusal_names_the_flag_at_fault",),
         "{flag} {path} already exists, and a fork starts its own {name} file: choose another {flag} file"),
    Rule("resume-other-file", "a resume is given a --metrics or --plot other than its own, which holds something",
         "refused (a resume continues its own files)",
         ("test_a_resume_never_wipes_another_runs_metrics",),
         "{flag} {path} already exists and is not this run's {name} file: choose another {flag} file (a resume "
         "continues its own files)"),
    Rule("resume-not-metrics", "a resume's --metrics file is not a vlseq-train metrics file",
         "refused rather than rewritten",
         ("test_a_resume_refuses_to_rewrite_a_file_that_is_not_its_metrics",),
         "--metrics {path} is not a vlseq-train metrics file ({why}); resuming would rewrite it: choose another "
         "--metrics"),
    Rule("resume-trims-metrics", "a resume's metrics file has records after the checkpoint's step",
         "they are dropped in place (one truncate: the file stays the one the run holds, live-output): the file "
         "reads as one uninterrupted run; records out of step order are refused as resume-not-metrics",
         ("test_resume_drops_metrics_written_after_the_checkpoint",
          "test_resume_repeats_the_uninterrupted_losses_exactly")),
    Rule("output-is-an-input", "an output is the --data file or the checkpoint resumed (or read by vlseq-predict)",
         "refused, --overwrite or not", ("test_an_output_that_is_an_input_or_another_output_is_refused",
                                         "test_bad_input_is_one_line_and_writes_nothing"),
         "{flag} {path} is the {other} file, which is read: choose another file"),
    Rule("outputs-collide", "two outputs of one run are one file, or an output is where standard output or "
         "standard error goes (--metrics log > log)", "refused, --overwrite or not",
         ("test_an_output_that_is_an_input_or_another_output_is_refused",
          "test_an_output_where_a_standard_stream_goes_is_refused"),
         "{flag} {path} is the {other} file: choose another file"),
    Rule("live-folder", "a run folder another live vlseq-train holds (flock on the folder)", "refused",
         ("test_a_run_folder_in_use_by_a_live_run_is_refused",),
         "--checkpoint-dir {dir}: another vlseq-train run is using this folder now; wait for it to finish, or choose "
         "another --checkpoint-dir"),
    Rule("live-output", "an output (--metrics, --plot, given or in the run folder) that another live vlseq-train "
         "writes: every run holds its output files as its folder (flock on the file, created empty until written)",
         "refused, --overwrite or not, before any other file rule is checked",
         ("test_a_live_runs_files_are_its_own", "test_two_runs_started_together_never_share_a_file"),
         "{flag} {path}: another vlseq-train run is writing this file now; wait for it to finish, or choose another "
         "{flag} file"),
    Rule("output-is-a-checkpoint", "an output of either command, other than the run's checkpoint, holds a checkpoint "
         "(a torch.save archive: another run's last.pt, say)", "refused, --overwrite or not",
         ("test_no_output_replaces_a_checkpoint_and_no_advice_leads_there",),
         "{flag} {path} holds a checkpoint, which no other output replaces (not even with --overwrite): choose "
         "another {flag} file"),
    Rule("another-runs-output", "an output of either command is the metrics.jsonl or loss.png of a folder that holds "
         "another run's checkpoint", "refused, --overwrite or not: that run resumes into it",
         ("test_no_output_replaces_a_checkpoint_and_no_advice_leads_there",
          "test_a_link_never_leads_a_run_into_another_runs_files"),
         "{flag} {path} is the {name} file of the run in {dir}, which resumes into it (not even --overwrite replaces "
         "it): choose another {flag} file"),
    Rule("streams", "an output that is a stream (/dev/null, a FIFO, /dev/stdout)",
         "written in place and appended to, never replaced or renamed over; it needs no file extension; a "
         "descriptor of the process (/dev/stdout) is written through a duplicate, which shares its offset (and "
         "appends behind a redirect to a file), so the run's own printing never overwrites it; a FIFO nothing reads "
         "yet is waited for with a warning",
         ("test_a_resume_appends_to_a_stream_and_never_replaces_it", "test_dev_null_as_the_plot",
          "test_a_stream_is_written_in_place_never_replaced", "test_outputs_on_redirected_standard_streams_stay_whole",
          "test_a_fifo_without_a_reader_is_waited_for_with_a_warning")),
    Rule("binary-to-a-terminal", "--plot is a terminal (/dev/stdout not redirected) and its format is binary",
         "refused before training: redirect it to a file", ("test_a_binary_plot_to_a_terminal_is_refused",),
         "--plot {path} is a terminal, and a {fmt} plot is binary: redirect it to a file, or give --plot a file "
         "name"),
    Rule("writable-up-front", "an output that cannot be written (a file as the folder, a folder as the file, no "
         "permission, a plot extension matplotlib lacks, a symbolic link loop, a closed descriptor), or a last.pt "
         "that is a symbolic link (the run writes its checkpoint in the folder it holds)", "refused before training",
         ("test_impossible_output_paths_are_refused_before_training",
          "test_a_symbolic_link_loop_as_an_output_is_one_line",
          "test_a_checkpoint_path_that_is_a_folder_is_refused_before_training",
          "test_a_descriptor_that_cannot_be_written_is_refused_up_front",
          "test_a_link_never_leads_a_run_into_another_runs_files")),
    Rule("default-run-folder", "no --checkpoint-dir",
         "the run claims its own runs/vlseq-<date>-<time>[-N] with mkdir (runs started in the same second too); "
         "a folder the run made and left empty is removed",
         ("test_runs_started_in_the_same_second_get_their_own_folders",
          "test_a_run_that_fails_after_taking_its_folder_leaves_no_folder")),
    Rule("absolute-outputs", "a new run's --metrics or --plot",
         "saved as an absolute, normalised path: a resume from another folder writes the same files, and "
         "other/../m.jsonl makes no other/",
         ("test_explicit_outputs_are_found_again_from_another_folder",
          "test_dot_dot_in_output_paths_makes_no_stray_folders")),
    Rule("outputs-move-with-the-folder", "a resumed run's --metrics or --plot, given inside its run folder, which has "
         "moved since (renamed or copied)", "written in the folder where the run is now, never in the old place",
         ("test_a_renamed_run_folder_resumes_where_it_is_now",)),
    Rule("resumed-data-path", "a resume from another folder, whose saved (relative) data path is not there",
         "refused: run from the run's folder, or pass --data",
         ("test_a_resume_from_another_folder_names_the_saved_data_path",),
         "--resume: the run's data {data} (saved in the checkpoint, relative to the folder the run started in) is "
         "not there from {cwd}: run from that folder, or pass --data"),
    Rule("atomic-writes", "a checkpoint, plot, prediction or metrics summary is written",
         "to a temporary file renamed over the old one: a failed write (a full disk) keeps the old file; the new "
         "file gets open()'s mode or the replaced file's; a symbolic link is written through",
         ("test_a_checkpoint_on_a_full_disk_keeps_the_previous_one",
          "test_kill_during_checkpoint_write_keeps_the_previous_checkpoint",
          "test_a_failed_write_leaves_the_old_file_and_no_temporary", "test_a_symbolic_link_is_written_through")),
    Rule("predict-outputs", "vlseq-predict's --out or --metrics exists",
         "replaced only with --overwrite (and never --data or --checkpoint: output-is-an-input)",
         ("test_bad_input_is_one_line_and_writes_nothing",),
         "{flag} {path} already exists: pass --overwrite to replace it, or choose another file"),
)


def refuse(key: str, **found: Any) -> NoReturn:
    """Raise the one line of rule `key` (CLIError), filled in with what the check found."""
    raise CLIError(RULES[key].message.format(**found))


# ------------------------------------------------------------------------------------------------
# the checks


def same_file(a: Path, b: Path) -> bool:
    """a and b name one file: the same path once links are followed, or one inode (a hard link)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except (OSError, RuntimeError):  # (a symbolic link loop: RuntimeError before Python 3.13)
        return False


def holds_something(path: Path) -> bool:
    """A regular file with content: an output that replacing would lose (an empty one loses nothing)."""
    return path.is_file() and path.stat().st_size > 0


def check_outputs_distinct(outputs: Sequence[Tuple[str, Path]], inputs: Sequence[Tuple[str, Path]] = ()) -> None:
    """No output is one of the input files or another output (output-is-an-input, outputs-collide)."""
    for i, (flag, path) in enumerate(outputs):
        for other, other_path in inputs:
            if same_file(path, other_path):
                refuse("output-is-an-input", flag=flag, path=path, other=other)
        for other, other_path in outputs[:i]:
            if same_file(path, other_path):
                refuse("outputs-collide", flag=flag, path=path, other=other)


# The names of a run's outputs in its folder, unless given elsewhere.
OUTPUT_NAMES = {"--metrics": "metrics.jsonl", "--plot": "loss.png"}
# torch.save's pickle format before its zip archives: the protocol-2 header and torch's magic number.
_LEGACY_TORCH = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


def holds_checkpoint(path: Path) -> bool:
    """A torch.save archive (a zip holding data.pkl, or the legacy pickle): a checkpoint, anyone's."""
    try:
        # O_NONBLOCK: opening a FIFO to look would wait for a writer
        with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return False
            head = fh.read(len(_LEGACY_TORCH))
        if head.startswith(_LEGACY_TORCH):
            return True
        if not head.startswith(b"PK\x03\x04"):
            return False
        with zipfile.ZipFile(path) as zf:
            return any(name.split("/")[-1] == "data.pkl" for name in zf.namelist())
    except Exception:  # noqa: BLE001 - not readable as an archive (OSError, BadZipFile, ...): not a checkpoint
        return False


def check_outputs_replaceable(outputs: Sequence[Tuple[str, Path]], run_dir: Optional[Path] = None) -> None:
    """No output (but the run's own checkpoint) replaces a checkpoint, or the metrics or plot of another
    run, whose folder (not run_dir) holds its checkpoint (output-is-a-checkpoint, another-runs-output)."""
    for flag, path in outputs:
        if holds_checkpoint(path):
            refuse("output-is-a-checkpoint", flag=flag, path=path)
        for where in {path, Path(os.path.realpath(path))}:  # (a symbolic link: where it points too)
            folder = where.parent
            if where.name in OUTPUT_NAMES.values() and (folder / CHECKPOINT_NAME).is_file() and \
                    not (run_dir is not None and same_file(folder, run_dir)):
                name = "metrics" if where.name == OUTPUT_NAMES["--metrics"] else "plot"
                refuse("another-runs-output", flag=flag, path=path, name=name, dir=folder)


def check_output_paths(config: Any, resumed: Optional[Path] = None) -> None:
    """The run's outputs can be written (writable-up-front, binary-to-a-terminal), and none is an input,
    another output, a checkpoint or another run's."""
    run_dir, metrics, plot = Path(config.checkpoint_dir), Path(config.metrics), Path(config.plot)
    check_dir(run_dir, "--checkpoint-dir")
    check_file(run_dir / CHECKPOINT_NAME, "--checkpoint-dir")  # (not a directory: found late)
    if (run_dir / CHECKPOINT_NAME).is_symlink():  # written through, it would land outside the folder the run holds
        raise CLIError(f"--checkpoint-dir {run_dir}: {CHECKPOINT_NAME} there is a symbolic link (to "
                       f"{os.readlink(run_dir / CHECKPOINT_NAME)}); a run writes its checkpoint in its own folder: "
                       "replace the link by a copy, or choose another --checkpoint-dir")
    check_file(metrics, "--metrics")
    check_file(plot, "--plot", plot_formats())
    fmt = plot.suffix.lower().lstrip(".") or "png"  # (the format write_plot uses)
    if is_terminal(plot) and fmt not in TEXT_PLOT_FORMATS:
        refuse("binary-to-a-terminal", path=plot, fmt=fmt)
    outputs = [("--metrics", metrics), ("--plot", plot)]
    data = Path(config.data)
    check_outputs_distinct(outputs + [("--checkpoint-dir", run_dir / CHECKPOINT_NAME)],
                           [("--data", data)] if data.exists() else [])
    if resumed is not None:
        check_outputs_distinct(outputs, [("--resume", resumed)])
    check_outputs_replaceable(outputs, run_dir)
    for flag, path in outputs + [("--checkpoint-dir", run_dir / CHECKPOINT_NAME)]:
        for name, std in (("standard output's", "/dev/stdout"), ("standard error's", "/dev/stderr")):
            # (--metrics log > log: the run's printing and its records would write over each other)
            if not is_stream(path) and os.path.exists(path) and same_file(path, Path(std)):
                refuse("outputs-collide", flag=flag, path=path, other=name)


def check_not_a_previous_run(config: Any, fork: bool = False) -> None:
    """A new run (or a fork into a new folder) must not replace an old run's checkpoint, metrics or plot
    (new-run-over-a-run, new-run-over-a-file, leftovers-without-checkpoint, fork-into-a-run)."""
    run_dir = Path(config.checkpoint_dir)
    ckpt = run_dir / CHECKPOINT_NAME
    outputs = [(ckpt, "--checkpoint-dir", True), (Path(config.metrics), "--metrics", config.metrics_default),
               (Path(config.plot), "--plot", config.plot_default)]
    found = [(p, flag, default) for p, flag, default in outputs if holds_something(p)]
    if not found:
        return
    names = ", ".join(str(p) for p, _, _ in found)
    if fork:
        in_folder = [p for p, _, default in found if default]
        if in_folder:
            refuse("fork-into-a-run", dir=run_dir, names=", ".join(map(str, in_folder)))
        path, flag, _ = found[0]
        refuse("fork-over-a-file", flag=flag, path=path, name=flag[2:])
    if ckpt.is_file():
        refuse("new-run-over-a-run", dir=run_dir, names=names)
    for path, flag, default in found:
        if not default:
            refuse("new-run-over-a-file", flag=flag, path=path)
    refuse("leftovers-without-checkpoint", dir=run_dir, names=names)


def check_new_output(path: Path, flag: str) -> None:
    """An output given now to a resumed run, other than the run's own: a file there is another's."""
    if holds_something(path):
        refuse("resume-other-file", flag=flag, path=path, name=flag[2:])


def check_resume_target(config: Any, resumed: Path, ckpt: Dict[str, Any]) -> None:
    """A resume writes its checkpoint to --checkpoint-dir/last.pt (resume-target)."""
    target = Path(config.checkpoint_dir) / CHECKPOINT_NAME
    if not target.exists() or same_file(target, resumed):
        return
    try:
        there = read_checkpoint(target, need=("config", "run"))
        run_id, step = there["config"].get("run_id"), int(there["run"]["step"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        run_id, step = None, None
    mine, resumed_step = ckpt["config"].get("run_id"), int(ckpt["run"]["step"])
    if mine is not None and run_id == mine and step is not None and step <= resumed_step:
        return  # an earlier point of this very run: continuing from a later copy loses nothing
    what = (f"step {step} of this run, later than the resumed step {resumed_step}"
            if mine is not None and run_id == mine else "another run")
    refuse("resume-target", dir=target.parent, target=target, what=what, resumed=resumed)
