# Shared by the trainers' run.sh files (sourced, not run).

# install_seqcache NAME VENV ROOT: seqcache from this checkout into the trainer's venv,
# every run, without its dependencies (the feeders need numpy, array_record and msgspec only,
# each trainer's requirements.txt pins them);
# build leftovers removed, as `make install` does, so no stale copy reaches a later wheel.
install_seqcache() {
  "$2/bin/pip" install -q --no-deps --force-reinstall "$3" \
    || { echo "$1: 0 passed, 1 failed (pip install seqcache)"; exit 1; }
  rm -rf "$3/build/lib" "$3"/build/bdist* "$3"/*.egg-info
}

# closing_line NAME LINE [skipped-fails]: pytest's last LINE as "NAME: N passed, N failed"
# (errors count as failures, and skips too when a third argument is given); the status
# is 0 only when something passed and nothing failed.
closing_line() {
  local passed failed errors skipped
  passed=$(grep -o '[0-9]* passed' <<<"$2" | cut -d' ' -f1)
  failed=$(grep -o '[0-9]* failed' <<<"$2" | cut -d' ' -f1)
  errors=$(grep -o '[0-9]* error' <<<"$2" | cut -d' ' -f1)
  skipped=0
  [ -n "${3:-}" ] && skipped=$(grep -o '[0-9]* skipped' <<<"$2" | cut -d' ' -f1)
  passed=${passed:-0}; failed=$(( ${failed:-0} + ${errors:-0} + ${skipped:-0} ))
  echo "$1: $passed passed, $failed failed"
  [ "$failed" = 0 ] && [ "$passed" -gt 0 ]
}
