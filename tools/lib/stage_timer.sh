# The stage timer of the repository's shell entry points; source it.
#   stage_done NAME [STATUS]   record how long the stage since the last one took
#   stage_report [TITLE]       print every recorded stage and the total
# STAGES holds the recorded lines (for a report written elsewhere too).
STAGES=()
_stage_start=$SECONDS
stage_done() {
  STAGES+=("$(printf '%-58s %5ds  %s' "$1" $((SECONDS - _stage_start)) "${2:-}")")
  _stage_start=$SECONDS
}
stage_report() {
  printf '\n==> %s (total %ds)\n' "${1:-stage times}" "$SECONDS"
  if [ "${#STAGES[@]}" -gt 0 ]; then printf '    %s\n' "${STAGES[@]}"; fi
}
