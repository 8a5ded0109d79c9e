# Sourced by the device scripts (acceptance_device.sh, long_context_device.sh) on the GPU machine:
# installs the bitsandbytes/peft wheels carried in .whl/ (if any) beside the repository on the
# Python path, and sets the offline, unbuffered environment the benches run in.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-}
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
