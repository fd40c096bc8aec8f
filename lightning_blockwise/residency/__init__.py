"""Where the frozen decoder tensors live: the byte layout (the one walk), the host arena, the streamer, placement.

``lightning_blockwise.residency`` was the module of the ``Residency`` interface before the
package grew folders; its names are still served here.
"""

from lightning_blockwise.residency.base import AlwaysResident, Pass, Residency

__all__ = ["AlwaysResident", "Pass", "Residency"]
