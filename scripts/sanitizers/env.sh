# Run-time options of the sanitizer builds (Note [Sanitizer builds] in
# cmake/fsdpSanitizers.cmake). Source it before running an instrumented
# test: `. scripts/sanitizers/env.sh`. Every rank process inherits them.
_fsdp_san_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# ASan: halt on the first error, with an exit code no test uses.
#   detect_leaks=0: a rank process ends with _exit(), which skips the leak
#     check, so only the test's parent process would be checked, and
#     LibTorch's static registries are not ours to suppress one by one.
#     test_wrap_rules and test_mixed_precision did pass with detect_leaks=1
#     (issue 19); turning it on for the whole run is still to be tried.
export ASAN_OPTIONS="halt_on_error=1:exitcode=86:detect_leaks=0:strict_init_order=1"
# UBSan: a finding aborts the test (the build also has -fno-sanitize-recover)
# and prints its stack.
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=87:suppressions=$_fsdp_san_dir/ubsan.supp"
# TSan: halt on the first race, second_deadlock_stack for lock-order reports;
# the suppressions file says why each entry is there.
export TSAN_OPTIONS="halt_on_error=1:exitcode=88:second_deadlock_stack=1:suppressions=$_fsdp_san_dir/tsan.supp"
unset _fsdp_san_dir
