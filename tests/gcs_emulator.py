"""A local Cloud Storage for tests: gcp-storage-emulator, with object generations.

    python -m tests.gcs_emulator --port=0 --bucket=bucket   # prints `http://localhost:PORT`

Clients reach it through their own variables, set by `environment(url)`: the Google clients and
gcsfs (and so etils.epath) read `STORAGE_EMULATOR_HOST`, tensorstore (and so Orbax) reads
`TENSORSTORE_GCS_HTTP_URL`.

The emulator (pure Python, on PyPI) lacks two things real Cloud Storage has and tensorstore's
OCDBT driver, the format Orbax writes, relies on for its atomic manifest updates: the
`x-goog-generation` header on downloads, and the `ifGenerationMatch` / `ifGenerationNotMatch`
preconditions (412 / 304). `serve` adds both around the emulator's own handlers; everything else
is the emulator's.
"""

from __future__ import annotations

import argparse
import functools
from http import HTTPStatus
import sys

# gcsfs's experimental zonal/hierarchical-namespace support asks each bucket's type through the
# gRPC storage-control API, which no emulator serves: every first access would wait out a 60 s
# timeout. Off for every client started with `environment`.
_GCSFS_EXPERIMENTAL = 'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT'


def environment(url: str) -> dict[str, str]:
  """The variables that point every Cloud Storage client of a process at `url`."""
  return {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
          _GCSFS_EXPERIMENTAL: 'false', 'GOOGLE_CLOUD_PROJECT': 'test'}


def _current_generation(request, storage) -> int | None:
  from gcp_storage_emulator.exceptions import NotFound  # pylint: disable=import-outside-toplevel
  params = request.params or {}
  name = params.get('object_id') or (request.query.get('name') or [None])[0]
  if not name and isinstance(request.data, dict):  # A multipart upload names it in its metadata.
    name = request.data.get('meta', {}).get('name')
  if not name:
    return None
  try:
    return int(storage.get_file_obj(params['bucket_name'], name)['generation'])
  except NotFound:
    return 0  # Cloud Storage's generation of an object that does not exist.


def _with_generations(handler):
  """`handler`, honouring preconditions and naming the generation it served."""

  @functools.wraps(handler)
  def wrapped(request, response, storage, *args, **kwargs):
    match = request.query.get('ifGenerationMatch')
    not_match = request.query.get('ifGenerationNotMatch')
    # The emulator serves one request at a time: a check and the write it guards are one step.
    if match or not_match:
      generation = _current_generation(request, storage)
      if match and generation != int(match[0]):
        response.status = HTTPStatus.PRECONDITION_FAILED
        return None
      if not_match and generation == int(not_match[0]):
        response.status = HTTPStatus.NOT_MODIFIED
        return None
    result = handler(request, response, storage, *args, **kwargs)
    if request.method == 'GET' and response.status == HTTPStatus.OK:
      generation = _current_generation(request, storage)
      if generation:
        response['x-goog-generation'] = str(generation)
        response['x-goog-metageneration'] = '1'
    return result

  return wrapped


def serve(host: str, port: int, bucket: str):
  """Starts the emulator in this process (in memory); returns the running server."""
  from gcp_storage_emulator import server  # pylint: disable=import-outside-toplevel
  server.HANDLERS = tuple((regex, {method: _with_generations(handler)
                                   for method, handler in handlers.items()})
                          for regex, handlers in server.HANDLERS)
  emulator = server.create_server(host, port, in_memory=True, default_bucket=bucket)
  emulator.start()
  return emulator


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--host', default='localhost')
  parser.add_argument('--port', type=int, default=0, help='0: any free port')
  parser.add_argument('--bucket', default='bucket')
  args = parser.parse_args(argv)
  import logging  # pylint: disable=import-outside-toplevel
  logging.disable(logging.WARNING)  # The emulator logs every 404 as an error.
  emulator = serve(args.host, args.port, args.bucket)
  print(f'http://{args.host}:{emulator._api._httpd.server_address[1]}', flush=True)  # pylint: disable=protected-access
  # Runs until its standard input closes: when the process that started it ends, after that
  # process's own exit handlers (tensorboardX uploads its event file once more at exit).
  sys.stdin.read()
  emulator.stop()


if __name__ == '__main__':
  sys.exit(main())
