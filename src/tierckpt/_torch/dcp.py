"""DCP's private names tierckpt's save, restore and ranged reads use (see the package's
table). Importing this module imports DCP."""

from __future__ import annotations

from typing import Any

import torch

from tierckpt._torch import untested

try:
    from torch.distributed.checkpoint import metadata as _metadata
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, set_element
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
except ImportError as e:  # a torch that moved one: say which, and what was tested
    raise ImportError(f"tierckpt's save and restore use DCP internals this torch lacks "
                      f"({e}); {untested('saving and restoring') or 'tested here'}") from e

StorageInfo = _StorageInfo
"""Where one DCP record lies in a file: ``(relative_path, offset, length)``."""
StoragePrefix = _StoragePrefix
"""The file-name prefix a rank's DCP files get (``__<rank>_``)."""
create_chunk_list = _create_chunk_list
"""The chunks a (possibly sharded) tensor is made of, as DCP plans them."""
get_layout = torch.serialization._get_layout
"""How a pickled ``torch.layout`` is looked up by name (an allowlisted global)."""
MEM_FORMAT_ENCODING = _metadata._MEM_FORMAT_ENCODING
"""How DCP's ``TensorProperties`` pickles a memory format (an allowlisted global)."""

__all__ = ["MEM_FORMAT_ENCODING", "StorageInfo", "StoragePrefix", "create_chunk_list",
           "flatten_state_dict", "get_layout", "narrow_tensor_by_index", "set_element"]


def narrow_tensor_by_index(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """``tensor`` narrowed to the box at ``offsets`` of ``sizes`` (DCP's helper)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index as narrow

    return narrow(tensor, offsets, sizes)
