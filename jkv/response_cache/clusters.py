"""Embedding-cluster ids: which knowledge-refresh group a prompt belongs to.

The cache stays model-agnostic: an embedder is any callable prompt -> vector (jkv hands in
the served model's mean-pooled hidden state). `KMeansClusterer` turns vectors into one of k
cluster ids with k-means (k-means++ seeding, Lloyd iterations, numpy only), and
`ClusterIdFn` composes the two into the prompt -> group-id callable the cache uses.

Vectors are L2-normalised by default, so clusters follow cosine similarity, the usual
geometry of embeddings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

FORMAT = "jkv-kmeans"
FORMAT_VERSION = 1


def _as_matrix(vectors: Any, what: str) -> np.ndarray:
    x = np.asarray(vectors, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{what} has shape {x.shape}; expected [n, dim] with n, dim >= 1")
    if not np.isfinite(x).all():
        raise ValueError(f"{what} contains NaN or infinity")
    return x


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norms == 0, 1.0, norms)


def _sq_dists(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    # ||x||^2 - 2 x.c + ||c||^2, clipped: rounding can make it slightly negative.
    d = (x * x).sum(1)[:, None] - 2 * x @ c.T + (c * c).sum(1)[None, :]
    return np.maximum(d, 0.0)


@dataclasses.dataclass(frozen=True, eq=False)
class KMeansClusterer:
    """Fitted k-means centroids; `assign` maps a vector to the nearest one's index.

    Attributes:
        centroids: `[k, dim]` float64.
        normalize: whether vectors are L2-normalised before fitting and assigning.
    """

    centroids: np.ndarray
    normalize: bool = True

    def __post_init__(self) -> None:
        c = _as_matrix(self.centroids, "centroids")
        c.setflags(write=False)
        object.__setattr__(self, "centroids", c)

    @property
    def k(self) -> int:
        return int(self.centroids.shape[0])

    @classmethod
    def fit(
        cls,
        vectors: Any,
        k: int,
        *,
        seed: int = 0,
        max_iter: int = 100,
        normalize: bool = True,
    ) -> KMeansClusterer:
        """Fits k centroids to sample vectors.

        Args:
            vectors: `[n, dim]` sample embeddings, n >= k.
            k: number of clusters (group ids 0..k-1).
            seed: RNG seed of the k-means++ seeding (same inputs, same centroids).
            max_iter: most Lloyd iterations.
            normalize: L2-normalise vectors first (cosine geometry).

        Returns:
            The fitted clusterer.

        Raises:
            ValueError: bad shapes, non-finite values, k < 1 or k > n.
        """
        x = _as_matrix(vectors, "vectors")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= x.shape[0]:
            raise ValueError(f"k={k!r} must be an integer in [1, {x.shape[0]}] (the sample size)")
        if normalize:
            x = _normalise(x)
        rng = np.random.default_rng(seed)
        centroids = [x[rng.integers(x.shape[0])]]
        closest = _sq_dists(x, np.stack(centroids))[:, 0]
        for _ in range(1, k):
            total = closest.sum()
            i = rng.choice(x.shape[0], p=closest / total) if total > 0 else rng.integers(len(x))
            centroids.append(x[i])
            closest = np.minimum(closest, _sq_dists(x, x[i : i + 1])[:, 0])
        c = np.stack(centroids)
        labels = None
        for _ in range(max_iter):
            d = _sq_dists(x, c)
            new = d.argmin(1)
            if labels is not None and np.array_equal(new, labels):
                break
            labels = new
            for j in range(k):
                members = x[labels == j]
                # An emptied cluster restarts at the point farthest from its centroid.
                c[j] = members.mean(0) if len(members) else x[d.min(1).argmax()]
        return cls(c, normalize)

    def assign(self, vector: Any) -> int:
        """The index of the nearest centroid.

        Args:
            vector: one `[dim]` embedding (list, tuple or array of floats).

        Returns:
            The cluster id in [0, k).

        Raises:
            ValueError: wrong dimension or non-finite values.
        """
        v = np.asarray(vector, dtype=np.float64).reshape(-1)
        if v.shape[0] != self.centroids.shape[1]:
            raise ValueError(
                f"vector has dimension {v.shape[0]}; centroids have {self.centroids.shape[1]}"
            )
        if not np.isfinite(v).all():
            raise ValueError("vector contains NaN or infinity")
        if self.normalize:
            v = _normalise(v[None, :])[0]
        return int(_sq_dists(v[None, :], self.centroids)[0].argmin())

    def save(self, path: str | os.PathLike) -> None:
        """Writes the centroids as JSON (floats round-trip exactly)."""
        doc = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "normalize": self.normalize,
            "centroids": self.centroids.tolist(),
        }
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)  # never leave a half-written file under the real name

    @classmethod
    def load(cls, path: str | os.PathLike) -> KMeansClusterer:
        """Reads centroids written by `save`.

        Raises:
            ValueError: not a jkv k-means file, or an unknown version.
        """
        with open(path, encoding="utf-8") as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)!r} is not JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{os.fspath(path)!r} is not a {FORMAT} file")
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{os.fspath(path)!r} has version {doc.get('version')!r}; expected {FORMAT_VERSION}"
            )
        return cls(np.asarray(doc["centroids"], dtype=np.float64), bool(doc["normalize"]))


@dataclasses.dataclass(frozen=True)
class ClusterIdFn:
    """prompt -> cluster id, composed of an embedder and a fitted clusterer.

    Attributes:
        embedder: prompt (str or token ids) -> vector.
        clusterer: anything with `assign(vector) -> int`, e.g. `KMeansClusterer`.
    """

    embedder: Callable[[Any], Any]
    clusterer: Any

    def __call__(self, prompt: Any) -> int:
        return int(self.clusterer.assign(self.embedder(prompt)))
