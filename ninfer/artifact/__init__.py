"""The `.ninfer` artifact: container (bytes, parts, checksums), logical view, converter, recipes."""

from ninfer.artifact.artifact import Artifact

__all__ = ["Artifact"]
