"""Search indexes, the public entry: build one (`build_index`, `build_index_from_embeddings`), open one
(`SearchIndex`), choose its FAISS kind (`FaissParams`).

Each fact has its own module, which the library's modules import directly; this one only names the public API:
`search.faiss_index` (FAISS kinds, knobs and automatic sizes), `search.sources` (what pictures a SOURCE names),
`search.chunks` (resumable encoding), `search.store` (the index folder, its reader and its one writing protocol),
`search.build` (`vse index`), `search.refresh` (`vse index --refresh`), `search.proxies` (one vector per picture).
"""

from vsekit.search.build import (
    build_index,
    build_index_from_embeddings,
    model_fingerprint,
    use_stored_features,
)
from vsekit.search.chunks import chunk_batches, encode_resumable
from vsekit.search.faiss_index import (
    INDEX_KINDS,
    IVF_KINDS,
    FaissParams,
    RefinedIndex,
    auto_nlist,
    auto_pq,
    build_faiss,
    check_trainable,
    ivfpq_train_size,
)
from vsekit.search.sources import Source, hash_pictures, read_extra_captions, resolve_source
from vsekit.search.store import (
    INDEX_FORMAT,
    RETRAIN_GROWTH,
    IndexFormatError,
    SearchIndex,
    append_segment,
    writer_lock,
)

__all__ = [
    "INDEX_FORMAT",
    "INDEX_KINDS",
    "IVF_KINDS",
    "RETRAIN_GROWTH",
    "FaissParams",
    "IndexFormatError",
    "RefinedIndex",
    "SearchIndex",
    "Source",
    "append_segment",
    "auto_nlist",
    "auto_pq",
    "build_faiss",
    "build_index",
    "build_index_from_embeddings",
    "check_trainable",
    "chunk_batches",
    "encode_resumable",
    "hash_pictures",
    "ivfpq_train_size",
    "model_fingerprint",
    "read_extra_captions",
    "resolve_source",
    "use_stored_features",
    "writer_lock",
]
