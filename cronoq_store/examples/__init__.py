"""Code the guides show whole and the tests run: `engine` (threads) and `aio_engine`
(asyncio), the loop of docs/engine.md."""
