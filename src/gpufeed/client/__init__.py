"""The reading side of the one read path: `reader` (Client: path → handle → hit, agent fetch or
source ranges), `plan` (pure: ranges → block pieces), `connection` (the agent socket), `file`
(the file object), `writer` (a file being written: staged for the agent to upload)."""

from gpufeed.client.file import FeedFile
from gpufeed.client.reader import Client, ObjectHandle
from gpufeed.client.writer import FeedWriter

__all__ = ["Client", "FeedFile", "FeedWriter", "ObjectHandle"]
