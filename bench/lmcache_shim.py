"""LMCache's ``LMCacheMPConnector`` as vLLM's CPU backend can load it, for ``bench.vllm_reuse``.

vLLM's CPU platform rebinds Triton kernels by scanning every loaded module and reading
``vars(obj)`` of objects that have a ``__dict__``; some objects LMCache imports have a
``__dict__`` that is not a mapping, and the scan stops the engine (``AttributeError:
'_lib_fn_wrapper' object has no attribute 'get'``). This module makes that scan skip such
objects, then hands vLLM the connector. It is named as the connector's module path
(``"kv_connector_module_path": "bench.lmcache_shim"``) only in the LMCache environment.
"""

from collections.abc import Mapping


def _mapping_vars(obj):
    namespace = vars(obj)
    return namespace if isinstance(namespace, Mapping) else {}


def __getattr__(name: str):
    if name != "LMCacheMPConnector":
        raise AttributeError(name)
    from vllm.triton_utils import dispatcher

    dispatcher.vars = _mapping_vars  # the module's lookups of the builtin now go here
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector import LMCacheMPConnector

    return LMCacheMPConnector
