"""The fault-injection suite: every failure flowfleet promises to survive, the test that injects it and
the outcome it asserts. conftest.py marks these tests `faults` (run them alone: `pytest -m faults`);
test_fault_suite.py checks that each one exists and that docs/reliability.md lists every case."""

FAULT_CASES: list[tuple[str, str, str]] = [
    # (case, pytest node id, asserted outcome)
    (
        "resume after stop",
        "tests/test_train_loop.py::test_stop_and_resume_is_bit_identical_to_an_uninterrupted_run",
        "S/2 steps, stop, resume to S: weights and EMA bit-identical to an uninterrupted run",
    ),
    (
        "prepare interrupted",
        "tests/test_prepare.py::test_resume_after_interruption_matches_an_uninterrupted_run",
        "continues from the last complete shard; shards equal an uninterrupted prepare",
    ),
    (
        "failure mid-checkpoint-write",
        "tests/test_train_checkpoint.py::test_crash_mid_write_leaves_previous_checkpoint_loadable",
        "the previous checkpoint stays the latest and loads",
    ),
    (
        "crash during checkpoint, then resume",
        "tests/test_train_loop.py::test_crash_during_a_checkpoint_then_resume_matches_uninterrupted",
        "resume from the previous checkpoint ends equal to an uninterrupted run",
    ),
    (
        "truncated checkpoint file",
        "tests/test_train_checkpoint.py::test_truncated_file_or_missing_pointer_falls_back_to_newest_complete",
        "falls back to the newest complete checkpoint",
    ),
    (
        "SIGTERM to a training process",
        "tests/test_train_cli.py::test_sigterm_to_the_command_checkpoints_marks_stopped_and_returns_0",
        "checkpoint written, status 'stopped', exit 0",
    ),
    (
        "preempted during a background checkpoint",
        "tests/test_train_cli.py::test_a_checkpoint_is_written_while_training_goes_on_and_a_kill_mid_write_leaves_the_last_complete_one",
        "training goes on during the write; SIGTERM then SIGKILL mid-write: the previous checkpoint loads and resumes",
    ),
    (
        "SIGTERM too late for a write",
        "tests/test_train_cli.py::test_a_sigterm_too_late_for_another_write_ends_on_the_newest_complete_checkpoint",
        "no checkpoint of the stop's step (said in one line); stopped on the newest complete one",
    ),
    (
        "SIGTERM to train-all",
        "tests/test_train_cli.py::test_fanout_stop_forwards_sigterm_and_starts_nothing_new",
        "forwarded to every job; nothing new starts",
    ),
    (
        "corrupt image",
        "tests/test_prepare.py::test_bad_images_are_skipped_and_missing_captions_counted",
        "skipped, counted and listed in the manifest; the run completes",
    ),
    ("missing caption", "tests/test_sources.py::test_folder_with_txt_captions_and_bad_files", "empty caption, counted"),
    (
        "truncated webdataset tar",
        "tests/test_sources.py::test_webdataset_truncated_tar_keeps_earlier_samples",
        "earlier samples kept, the damage reported",
    ),
    (
        "missing source",
        "tests/test_prepare.py::test_missing_source_is_one_line_naming_it",
        "one-line error naming the source",
    ),
    (
        "empty cluster",
        "tests/test_cluster.py::test_empty_partition_is_reseeded_then_refused",
        "re-seeded; a partition that stays empty is an error, never an empty expert",
    ),
    (
        "incompatible expert at assemble",
        "tests/test_assemble.py::test_incompatible_expert_is_refused_naming_expert_and_field",
        "refused with one line naming the expert and the field",
    ),
    (
        "corrupted expert weights",
        "tests/test_assemble.py::test_corrupted_expert_weights_are_refused",
        "refused with one line naming the file",
    ),
    (
        "corrupted model config",
        "tests/test_model_files.py::test_corrupted_config_is_refused",
        "refused with one line naming config.json",
    ),
    (
        "NaN loss",
        "tests/test_train_loop.py::test_run_of_non_finite_losses_stops_and_keeps_the_last_good_checkpoint",
        "stops with status 'failed' and a message; last good checkpoint intact and finite",
    ),
    (
        "second job for a running expert",
        "tests/test_train_loop.py::test_second_copy_of_a_running_job_is_refused",
        "refused while the lease is live; taken over once the heartbeat is stale",
    ),
    (
        "dead rank during parallel generation",
        "tests/test_parallel_dit.py::test_failing_rank_gives_clear_error_within_timeout[dead]",
        "the other rank fails with a clear error within the timeout",
    ),
    (
        "stalled rank during parallel generation",
        "tests/test_parallel_dit.py::test_failing_rank_gives_clear_error_within_timeout[stalled]",
        "the other rank fails with a clear error within the timeout",
    ),
    (
        "transient storage errors during upload",
        "tests/test_faults_storage.py::test_transient_upload_errors_are_retried_through_a_whole_run",
        "retried with backoff through prepare, cluster and training; the run completes",
    ),
    (
        "storage unreachable",
        "tests/test_faults_storage.py::test_persistent_storage_failure_is_one_clear_error",
        "one error naming the object after 5 attempts",
    ),
    (
        "failed local write",
        "tests/test_storage.py::test_failed_write_leaves_the_old_file_and_no_temp",
        "the old file is intact and no temp file remains",
    ),
    (
        "unpickling from a run root",
        "tests/test_safety.py::test_no_unpickling_or_eval_in_the_package",
        "no torch.load / pickle / eval anywhere in the package",
    ),
]
