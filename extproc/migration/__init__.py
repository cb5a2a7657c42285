"""In-flight migration (README.md): a stream whose engine dies goes on at the decision's next host, through
the migration proxy. Sans IO: the continuation request and the stream splicing; proxy.py is the shell."""
