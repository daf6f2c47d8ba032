"""The API side of `autotp serve`, on rank 0's HTTP thread: what is refused at the door, the protocols (OpenAI,
TGI), `/metrics`, and the FastAPI app. No torch: it hands rows to the engine and answers with what comes back."""
