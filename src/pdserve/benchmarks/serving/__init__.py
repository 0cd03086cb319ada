"""A deployment under load, through the APIs its users call: the client and
the OpenAI HTTP API against a running or freshly started deployment
(`bench serve`), pdserve against llama.cpp's server on the same GGUF
(`bench peer`), faults and a killed engine under load (`bench soak`), the
autoscaler under a rising and falling load (`bench autoscale`), and what
a token (`bench tokens`) and a control call (`bench control-plane`) cost
on their way between engine and router."""
