"""pagedkv's tiers inside SGLang 0.5.23: `PagedKVStore`, a HiCache storage backend loaded by
configuration alone (docs/tiers.md, "Under SGLang"):

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "pagedkv", "module_path": "pagedkv.sglang",
      "class_name": "PagedKVStore", "interface_v1": 1, "host_bytes": "8GiB"}'

Importing this package imports SGLang (`pip install '.[sglang]'`); `import pagedkv`
never does.
"""

from __future__ import annotations

from pagedkv.sglang.store import PagedKVStore

__all__ = ["PagedKVStore"]
