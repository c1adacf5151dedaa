# The one interpreter finder of the repository's shell entry points; source it.
#   find_python X.Y   print the path of a Python X.Y that runs (empty X.Y: python3),
#                     found on PATH as pythonX.Y or under pyenv's versions; fail if none
find_python() {
  local v=$1 candidate
  if [ -z "$v" ]; then command -v python3; return; fi
  for candidate in "python$v" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v"*/bin/python"$v"; do
    # A pyenv shim is on PATH but fails unless that version is selected: take one that runs.
    if "$candidate" -c 'import sys' >/dev/null 2>&1; then
      command -v "$candidate"
      return
    fi
  done
  return 1
}
