"""Embedding-cluster ids: k-means on numpy, persistence, composition with an embedder."""

from __future__ import annotations

import numpy as np
import pytest

from jkv.response_cache import ClusterIdFn, KMeansClusterer


def blobs(rng, k=4, per=50, dim=8):
    centres = rng.normal(size=(k, dim)) * 10
    points = np.concatenate([c + rng.normal(size=(per, dim)) for c in centres])
    return points, np.repeat(np.arange(k), per)


def test_kmeans_recovers_separated_clusters():
    points, truth = blobs(np.random.default_rng(0))
    km = KMeansClusterer.fit(points, 4, seed=1, normalize=False)
    labels = np.array([km.assign(p) for p in points])
    # The same partition up to renaming: each true cluster maps to exactly one id.
    pairs = {(t, label) for t, label in zip(truth, labels, strict=True)}
    assert len(pairs) == 4 and len({label for _, label in pairs}) == 4


def test_fit_is_deterministic_and_assign_returns_python_ints():
    points, _ = blobs(np.random.default_rng(2))
    a = KMeansClusterer.fit(points, 3, seed=5)
    b = KMeansClusterer.fit(points, 3, seed=5)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    assert type(a.assign(points[0].tolist())) is int and a.k == 3


def test_save_load_round_trip(tmp_path):
    points, _ = blobs(np.random.default_rng(3))
    km = KMeansClusterer.fit(points, 4)
    path = tmp_path / "centroids.json"
    km.save(path)
    back = KMeansClusterer.load(path)
    np.testing.assert_array_equal(back.centroids, km.centroids)
    assert back.normalize == km.normalize
    assert [back.assign(p) for p in points] == [km.assign(p) for p in points]


def test_load_rejects_other_files(tmp_path):
    (tmp_path / "x.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a jkv-kmeans file"):
        KMeansClusterer.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        KMeansClusterer.load(tmp_path / "y.json")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="k=5"):
        KMeansClusterer.fit(np.ones((4, 2)), 5)
    with pytest.raises(ValueError, match="shape"):
        KMeansClusterer.fit(np.ones(4), 1)
    with pytest.raises(ValueError, match="NaN"):
        KMeansClusterer.fit([[0.0, float("nan")]], 1)
    km = KMeansClusterer.fit(np.eye(3), 3)
    with pytest.raises(ValueError, match="dimension 2"):
        km.assign([1.0, 0.0])


def test_duplicate_points_still_give_k_centroids():
    km = KMeansClusterer.fit(np.ones((10, 3)), 3)
    assert km.centroids.shape == (3, 3) and np.isfinite(km.centroids).all()


def test_cluster_id_fn_composes_embedder_and_clusterer():
    km = KMeansClusterer.fit([[1.0, 0.0], [0.0, 1.0]], 2)
    table = {"cat": [0.9, 0.1], "stock": [0.1, 0.9]}
    group_of = ClusterIdFn(table.__getitem__, km)
    assert group_of("cat") == km.assign([1.0, 0.0]) != group_of("stock")
