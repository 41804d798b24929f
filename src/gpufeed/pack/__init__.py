"""Packs: many small files as ranges of a few big shard objects, under their original paths.

`packer` writes a pack (`gpufeed pack`), `index` is its format, `plan` the pure layout rules,
`mounting` turns a pack, or a WebDataset tar set read in place, into manifest entries whose
reads are ranges of their shard (`ObjectInfo.pack_key/pack_offset/pack_length`).
"""
