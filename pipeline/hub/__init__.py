"""How mxspec reaches the Hugging Face Hub: the endpoint, token and offline switch (`env`), the HTTP
policy of time limits and retries (`http`), and the upload protocol that makes a repo equal to a plan
(`upload`)."""
